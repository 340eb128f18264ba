"""Colossal-AI's ``colossalai.tensor.d_tensor`` names a test imports."""

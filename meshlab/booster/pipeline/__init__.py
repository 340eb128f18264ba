"""Colossal-AI's ``colossalai.pipeline`` names a script imports (``schedule.v_schedule``)."""

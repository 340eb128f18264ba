"""Colossal-AI's ``colossalai.pipeline.schedule`` names a script imports."""

from .v_schedule import PipelineGraph as PipelineGraph

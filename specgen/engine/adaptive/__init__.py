"""Adaptive speculation: how many drafts each slot verifies per step (0 included), from step costs measured on
this machine and each slot's running acceptance. costs.py prices steps, estimator.py keeps acceptance,
decide.py makes the one choice, controller.py ties them to the step loop, calibrate.py times the table."""
from specgen.engine.adaptive.controller import Controller, StepReport
from specgen.engine.adaptive.costs import CostModel
from specgen.engine.adaptive.decide import choose_drafts

__all__ = ["Controller", "CostModel", "StepReport", "choose_drafts"]

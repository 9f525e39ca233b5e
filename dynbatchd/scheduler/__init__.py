"""Pure, clock-injected scheduling: channels, batch closing and dispatch order."""

from dynbatchd.scheduler.batcher import Decision, Scheduler, build_channels
from dynbatchd.scheduler.channel import Batch, Channel, Item
from dynbatchd.scheduler.policies import MS, CostModel, FixedWindow, LaneState, StaticSizer

__all__ = ["Batch", "Channel", "CostModel", "Decision", "FixedWindow", "Item", "LaneState", "MS",
           "Scheduler", "StaticSizer", "build_channels"]

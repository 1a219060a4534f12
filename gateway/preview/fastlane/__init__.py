"""The preview fast lane (being split into modules: see front.py for now)."""

from gateway.preview.fastlane.front import FastLane, FastSite, bind, run_app

__all__ = ["FastLane", "FastSite", "bind", "run_app"]

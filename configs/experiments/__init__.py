"""Configs of one-off experiments (ablations, stability studies); size presets and demos
stay in configs/."""

"""Model level: the unit list, presets, costs, partition search and pipeline simulation."""

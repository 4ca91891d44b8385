"""The pure core: config, schedule, window plan, runs, state, aggregation, validation, paths.

Runs anywhere and imports neither Ray nor torch; of this project it imports only
``coordinator.core`` and ``coordinator.protocol`` (checked by ``tests/test_house_rules.py``).
"""

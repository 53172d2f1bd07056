"""Systems model: roofline cost model, discrete-event simulator of sync and pipeline RL, split planner.

See docs/SIMULATOR.md. Entry points: `simulate.simulate_sync` / `simulate_pipeline`, `planner.plan`,
`planner.predict`, `calibrate.fit_calibration`, and the `jaxrl-plan` app in `plan.py`.
"""

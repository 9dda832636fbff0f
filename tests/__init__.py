"""ctrflow's tests; `tests.fixtures` holds what several test modules share."""

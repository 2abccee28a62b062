"""Pure parts of the parameter server: messages, state, optimizer, buffer, layout, clocks,
metrics. No Ray, no processes; unit-tested directly."""

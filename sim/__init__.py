"""The discrete-event simulator: topology, collectives, plan, cost models, engine, memory. Never imports torch."""

"""The agent: shared-memory arena and slots, replica store, buddy placement, the wire
protocol and transfers between agents. Nothing here imports torch."""

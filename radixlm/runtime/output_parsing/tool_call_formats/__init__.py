"""One module per model family's tool-call format; ``tool_call_registry`` maps names to them."""

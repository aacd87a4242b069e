"""How a wehub-ps process runs: structured logging and malloc tuning."""

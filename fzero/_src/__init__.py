"""fzero's implementation. Private: import public names from `fzero`."""

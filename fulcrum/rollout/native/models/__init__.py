"""Model definitions of the native engine (one file per architecture family)."""

"""The native engine's decoder (decoder.py); what each architecture family is lives in its spec
(`fulcrum.models.arch`)."""

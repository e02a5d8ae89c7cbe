"""Speculative decoding's proposers: where draft tokens come from (the verify step that
checks them is the scheduler's: ``scheduler/speculative_decode.py``)."""

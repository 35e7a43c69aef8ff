"""Selective recompute over the translated cache: heterofold's faithful mode.

After translation the receiver recomputes its own K/V, through all its layers, for a chosen share f of
the context tokens and writes them over the translated ones. rules.py chooses the tokens (a table of
named rules), recompute_pass.py runs the pass and measures the cheap signals, estimate.py predicts this
request's agreement with native prefill from them, settings.py names what a stage measured at.
"""

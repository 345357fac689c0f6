"""Fault injection: the chaos spec and the monkey that fires it at a running job."""

"""Examples and test fixtures built on the library: tiny models, synthetic datasets, the Text and VLM trainers.

Nothing in the library imports from here.
"""

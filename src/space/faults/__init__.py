"""Fault injection shared by every component (standard library only; imports nothing of SPACE).

It is a layer of its own because it does what `space.core` must not (it kills its own process and appends
to a journal file) while every layer that has named steps — the control plane, the node agent, the root
helper, the object store — must be able to call it. See failpoints.py.
"""

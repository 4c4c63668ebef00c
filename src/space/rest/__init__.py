"""HTTP plumbing shared by every HTTP surface of SPACE (the control plane's API and the node agent's RPC).

Layer rule: imports only space.core and web libraries (FastAPI/Starlette); space.node and
space.controlplane import it, never the reverse.
"""

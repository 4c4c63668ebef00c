"""The control plane's client of a node agent's RPC by concern, assembled as space.node.rpc_client.NodeClient.

transport (HTTP, auth, capabilities, error translation) under lifecycle, transfer (object storage),
processes, files and relay (the gateway's pass-through); each concern is a class of calls on the transport.
"""

"""HTTP through the egress gateway, one request at a time, in four stages, each its own module:

1. decide (decide.py, target.py): may this request go out, and to which checked addresses (a Route);
2. substitute (substitute.py): credential placeholders replaced by values, per the credential rules;
3. forward (forward.py): the request sent upstream, the response streamed back;
4. scrub (scrub.py): every injected value removed from what goes back to the sandbox.

session.py runs them for each request of a client connection; messages.py holds what they share.
"""

"""The node channel: the transport between a controller and its nodes, shared by both roles.

What is here is mechanics, never protocol: what a verified message *means* is decided by the
controller's `control.fleet.southbound` and by the node's agent.

* `links`: `Link` (the controller's CurveZMQ ROUTER, per-node routes) and `Uplink` (a node's
  DEALER), Curve25519 key files, signing and verifying on the way through;
* `zap`: which Curve keys may open a channel (ZeroMQ's RFC 27 handler the `Link` binds);
* `pump`: the one task that moves a zmq socket's messages (bounded inbox and outbox);
* `framing`: the frames, signed `[kind, body, signature]` and data-path `[kind, request_id, head,
  body]` (pure: no I/O);
* `flow`: credit flow control on the data path, the node's `SendWindow` and the controller's
  `CreditReturn` (a request's chunks at most a window ahead of the credit returned);
* `endpoints`: Curve-key endpoints and their make-before-break rotation: the controller's two
  endpoints (`ServedEndpoints`: serve a rotation's next key beside the current one, then retire the
  old) and a node's channel across its own or the controller's key rotation (`NodeChannel`).

It imports neither `nexa.control` nor `nexa.node` (an import contract says so), and it is the only
package that imports `zmq`.
"""

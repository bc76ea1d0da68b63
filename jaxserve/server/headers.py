"""The request and response metadata keys the front ends and the router share (gRPC metadata,
HTTP headers alike)."""

SESSION_HEADER = "x-session-affinity"  # a session's id: its requests keep their worker
REPLICA_HEADER = "x-jaxserve-replica"  # the replica that answered
REQUEST_ID_HEADER = "x-request-id"  # the request's id, generated or the client's

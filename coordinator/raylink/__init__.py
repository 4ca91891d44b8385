"""Ray glue shared by every process that calls ranks without loading their code: the
coordinator actor and the node agents. It imports Ray and the protocol, never torch."""

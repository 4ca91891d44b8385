"""What crosses Ray: the declared replies, the summary wire format, the rank RPCs and the
names of the actors. Pure; of this project it imports only ``coordinator.protocol``."""

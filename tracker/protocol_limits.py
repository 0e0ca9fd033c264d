"""Field limits shared by both versions of the marker wire format (docs/protocol.md)."""

MAX_GROUP_LENGTH = 255
MAX_CONSUMER_LENGTH = 255
MAX_REASON_LENGTH = 4096
MAX_ATTEMPT = 0xFFFF
MAX_TIMEOUT_MS = 0xFFFFFFFF  # ~49.7 days: the longest lease one START or EXTEND can ask for
MAX_DELAY_MS = 3650 * 24 * 3600 * 1000  # ten years: far beyond any real retention
MAX_PARTITION = 2**31 - 1
MAX_OFFSET = 2**63 - 1

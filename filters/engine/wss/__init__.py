"""WS-Security: tokens, timestamps, signatures, encryption, keys and the replay rule, inbound and outbound."""

"""WS-SecureConversation and WS-Trust: security contexts, their tokens and derived keys, Issue and Cancel."""

"""The proxies' HTTP: the upstream client, de-chunking, forwarding and the raw relay."""

"""The proxies' HTTP: the one upstream client, de-chunking, forwarding and the relay."""

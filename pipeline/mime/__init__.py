"""Raw RFC 5322 bytes to MessageData: headers, parts, charsets, and parse worker processes."""

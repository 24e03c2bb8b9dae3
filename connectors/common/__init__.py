"""What both connectors share, below them both: connector names, hosts, metrics, and how a connector
starts (this process's launch check). Nothing here imports a connector."""

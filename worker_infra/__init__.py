"""What both workers' servers share, beside the connector: HTTP helpers (errors, bodies, the
allow-list of bootstrap hosts, admin keys, serving until stopped), sleep coordination (the
gate requests pass) and Prometheus metrics. The connector depends on none of it."""

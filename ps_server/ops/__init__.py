"""Running a ps-server: configuration from flags, environment and TF_CONFIG, the
command line, and Prometheus metrics.
"""

"""Export subscriptions: Cloud Storage written to a local directory; BigQuery and Bigtable checked."""

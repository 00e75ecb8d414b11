"""Adapters: the run's DynamoDB table (pynamodb), its S3 bucket and the connection to both."""

"""Names of the files a worker writes into its staging directory besides the outputs."""

RESULT_NAME = ".epbuild-result.json"
LOG_NAME = ".epbuild-worker.log"

"""The parent process: compose and validate the config, start and supervise the workers, summarise."""

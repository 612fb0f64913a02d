"""The `reviva` command line (`python -m reviva`): its parser (main.py) and one module per
command: demo, transfers, plan and plan --train (the models they take: models.py).

May import everything below it, and the public package (`import reviva`)."""

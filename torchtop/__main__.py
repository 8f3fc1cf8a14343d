from torchtop.cli import main_entry

main_entry()

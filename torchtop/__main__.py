from torchtop.commands import main_entry

main_entry()

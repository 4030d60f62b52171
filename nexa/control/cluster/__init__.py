"""The cluster plane: several controllers on one shared store. Which one leads (`leadership`), how
the others keep their state up with its writes (`follow`) and pass management writes to it (`forward`)."""

"""Everything that runs the model, in subpackages by concern, each importing only those
before it (tests/test_layers.py):

outputs < model < data < state < hf < evaluation < train

outputs/ what the user sees and keeps; model/ the network and its loss; data/ tokens in;
state/ the train state built, stepped and saved; hf/ Hugging Face folders in and out;
evaluation/ loss by position and retrieval; train/ the loop and what runs beside it."""

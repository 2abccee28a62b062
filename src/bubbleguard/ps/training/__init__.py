"""What is trained: data sets behind a small interface, the model, gradients and evaluation."""

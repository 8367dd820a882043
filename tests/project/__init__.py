"""The project as a user gets it: the Helm chart, the image, the demo, the docs and the code's layout."""

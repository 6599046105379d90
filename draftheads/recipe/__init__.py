"""Recipes: one typed YAML file and one command take a target to a packaged head with its measurements
(``draftheads recipe run recipes/NAME.yaml``). :mod:`~draftheads.recipe.config` is the file,
:mod:`~draftheads.recipe.stages` its stages, :mod:`~draftheads.recipe.runner` the one stage runner,
:mod:`~draftheads.recipe.store` the data store and :mod:`~draftheads.recipe.package` head packaging."""

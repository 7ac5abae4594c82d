"""Plugin objects the plugin-manager tests point entry points at."""

from tandem import hookimpl


class ModelPlugin:
    def __init__(self, arch: str, target: str, override: bool = False) -> None:
        self.arch, self.target, self.override = arch, target, override

    @hookimpl
    def tandem_register_models(self, registry) -> None:
        registry.register_model(self.arch, self.target, override=self.override)


class BackendPlugin:
    def __init__(self, name: str, target: str) -> None:
        self.name, self.target = name, target

    @hookimpl
    def tandem_register_attention_backends(self, registry) -> None:
        registry.register_backend(self.name, self.target)


class Raising:
    @hookimpl
    def tandem_register_models(self, registry) -> None:
        raise KeyError("config key 'hidden' missing")


fancy = ModelPlugin("FancyModel", "tandem.model_zoo.bart:BartForConditionalGeneration")
fancy_again = ModelPlugin("FancyModel", "some_pkg.models:OtherFancy")
fancy_override = ModelPlugin("FancyModel", "some_pkg.models:OtherFancy", override=True)
backend = BackendPlugin("my_backend", "fake_backends:MyBackend")
misnamed_backend = BackendPlugin("my_backend", "fake_backends:MisnamedBackend")
subclass_keeping_parent_name = BackendPlugin("my_backend", "fake_backends:InheritsItsName")
not_a_backend = BackendPlugin("not_a_backend", "fake_backends:NotABackend")
nameless_backend = BackendPlugin("nameless", "fake_backends:NamelessBackend")
raising = Raising()


class Exiting:
    @hookimpl
    def tandem_register_attention_backends(self, registry) -> None:
        raise SystemExit(3)


exiting = Exiting()


class Interrupted:
    @hookimpl
    def tandem_register_models(self, registry) -> None:
        raise KeyboardInterrupt


interrupted = Interrupted()


class Misspelled:
    @hookimpl
    def tandem_register_model(self, registry) -> None:  # missing the final "s"
        registry.register_model("Never", "x.y:Z")


misspelled = Misspelled()
missing_target = ModelPlugin("GhostModel", "no_such_package.models:Ghost")

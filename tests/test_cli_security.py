"""A selection YAML may name only classes of the expected kind: nothing else is ever called."""
from __future__ import annotations

import pytest
import yaml

from lightning_marglik.selection import instantiate, run_command_line, select_from_config

DATA = {"class_path": "tests.lightning_models.BlobData", "init_args": {"n_train": 30}}
CANDIDATE = {"class_path": "tests.lightning_models.Classifier", "init_args": {"width": 2}}


def shell(marker) -> dict:
    """``os.system("touch marker")`` written as a class_path: what an attacker's YAML would hold."""
    return {"class_path": "os.system", "init_args": {"command": f"touch {marker}"}}


def test_os_system_candidate_is_refused_and_never_runs(tmp_path, capsys):
    marker = tmp_path / "marker"
    config = {"data": DATA, "candidates": {"evil": shell(marker)}, "trainer": {"max_epochs": 1}}
    with pytest.raises(ValueError, match=r"class_path 'os.system' is a builtin_function_or_method, not a subclass "
                                         r"of pytorch_lightning.LightningModule: refused"):
        select_from_config(config)
    path = tmp_path / "evil.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        run_command_line([str(path)])
    assert exit_info.value.code == 2
    assert "class_path 'os.system'" in capsys.readouterr().err
    assert not marker.exists()


def test_os_system_data_is_refused_and_never_runs(tmp_path, capsys):
    marker = tmp_path / "marker"
    config = {"data": shell(marker), "candidates": {"ok": CANDIDATE}}
    with pytest.raises(ValueError, match=r"class_path 'os.system' .* not a subclass of pytorch_lightning.LightningDataModule"):
        select_from_config(config)
    path = tmp_path / "evil.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit):
        run_command_line([str(path)])
    assert "os.system does not correspond to a subclass of LightningDataModule" in capsys.readouterr().err
    assert not marker.exists()


@pytest.mark.parametrize("class_path, expected_kind", [
    ("collections.OrderedDict", "class collections.OrderedDict"),      # a class, but not a model
    ("tests.lightning_models.BlobData", "class tests.lightning_models.BlobData"),  # data where a model belongs
    ("subprocess.run", "function"),
])
def test_wrong_kinds_of_candidate_are_refused(class_path, expected_kind):
    with pytest.raises(ValueError, match=f"class_path '{class_path}' is a {expected_kind}, not a subclass of "
                                         "pytorch_lightning.LightningModule"):
        select_from_config({"data": DATA, "candidates": {"ok": CANDIDATE, "bad": {"class_path": class_path}}})


def test_unimportable_class_path_names_what_was_expected():
    import pytorch_lightning as pl

    with pytest.raises(ValueError, match=r"class_path 'no_such_module.Model' \(expected a pytorch_lightning.LightningModule"):
        instantiate({"class_path": "no_such_module.Model"}, pl.LightningModule)
    with pytest.raises(ValueError, match="must be a dotted path"):
        instantiate({"class_path": "eval"}, pl.LightningModule)

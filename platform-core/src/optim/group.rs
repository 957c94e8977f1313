//! Parameter groups: per-group learning rate and weight decay, selected by name.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Which parameters a [`ParamGroup`] takes, by their dotted names.
///
/// In a config file: `params = "all"`, `params = { prefix = "encoder." }`,
/// `params = { suffix = "bias" }` or `params = { names = ["fc.weight"] }`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParamSelector {
    /// Every parameter.
    All,
    /// Parameters whose name starts with the string (`"encoder."`).
    Prefix(String),
    /// Parameters whose name ends with the string (`"bias"`, for a no-decay group).
    Suffix(String),
    /// Exactly these parameters; each must exist.
    Names(Vec<String>),
}

impl ParamSelector {
    /// Whether the selector takes the parameter `name`.
    ///
    /// ```
    /// use kiln_core::optim::ParamSelector;
    ///
    /// assert!(ParamSelector::Suffix("bias".into()).matches("fc.bias"));
    /// assert!(!ParamSelector::Prefix("encoder.".into()).matches("decoder.0.weight"));
    /// ```
    pub fn matches(&self, name: &str) -> bool {
        match self {
            ParamSelector::All => true,
            ParamSelector::Prefix(p) => name.starts_with(p.as_str()),
            ParamSelector::Suffix(s) => name.ends_with(s.as_str()),
            ParamSelector::Names(names) => names.iter().any(|n| n == name),
        }
    }

    fn describe(&self) -> String {
        match self {
            ParamSelector::All => "all parameters".to_owned(),
            ParamSelector::Prefix(p) => format!("prefix `{p}`"),
            ParamSelector::Suffix(s) => format!("suffix `{s}`"),
            ParamSelector::Names(n) => format!("names {n:?}"),
        }
    }
}

/// Options for a subset of the parameters (PyTorch's `param_groups`); unset
/// options take the optimizer's value.
///
/// ```
/// use kiln_core::optim::{assign_groups, ParamGroup, ParamSelector};
///
/// let names: Vec<String> = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
///     .map(String::from)
///     .to_vec();
/// let groups = [ParamGroup::new("no_decay", ParamSelector::Suffix("bias".into())).with_weight_decay(0.0)];
/// // Biases go to group 0; the weights to the implicit default group 1.
/// assert_eq!(assign_groups(&names, &groups)?, vec![1, 0, 1, 0]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamGroup {
    /// A name for messages and logs (unique among the groups).
    pub name: String,
    /// The parameters this group takes (unless an earlier group took them).
    pub params: ParamSelector,
    /// Learning rate of this group, or `None` for the optimizer's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// Weight decay of this group, or `None` for the optimizer's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<f64>,
}

impl ParamGroup {
    /// A group with the optimizer's learning rate and weight decay.
    pub fn new(name: impl Into<String>, params: ParamSelector) -> Self {
        ParamGroup {
            name: name.into(),
            params,
            lr: None,
            weight_decay: None,
        }
    }

    /// Sets the group's learning rate.
    pub fn with_lr(mut self, lr: f64) -> Self {
        self.lr = Some(lr);
        self
    }

    /// Sets the group's weight decay.
    pub fn with_weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = Some(weight_decay);
        self
    }
}

/// The group index of each parameter in `names`: the first group whose
/// selector matches wins; parameters no group matches get `groups.len()`, an
/// implicit default group after the given ones.
///
/// Fails with [`Error::InvalidArgument`] naming the group when a group
/// receives no parameter (its selector matches nothing, or only parameters an
/// earlier group took), when [`ParamSelector::Names`] lists a parameter that
/// does not exist, when two groups share a name, or when a group's `lr` or
/// `weight_decay` is negative or not finite.
pub fn assign_groups(names: &[String], groups: &[ParamGroup]) -> Result<Vec<usize>> {
    let mut seen = BTreeSet::new();
    for group in groups {
        let field = |f: &str| format!("param_groups.{}.{f}", group.name);
        if !seen.insert(group.name.as_str()) {
            return Err(Error::invalid_argument(
                field("name"),
                format!("two parameter groups are named `{}`", group.name),
            ));
        }
        for (option, value) in [("lr", group.lr), ("weight_decay", group.weight_decay)] {
            if let Some(v) = value {
                if !(v.is_finite() && v >= 0.0) {
                    return Err(Error::invalid_argument(
                        field(option),
                        format!("must be finite and >= 0, got {v}"),
                    ));
                }
            }
        }
        if let ParamSelector::Names(listed) = &group.params {
            if let Some(missing) = listed.iter().find(|n| !names.contains(n)) {
                return Err(Error::invalid_argument(
                    field("params"),
                    format!(
                        "group `{}` lists parameter `{missing}`, which the model does not have",
                        group.name
                    ),
                ));
            }
        }
    }

    let assignment: Vec<usize> = names
        .iter()
        .map(|name| {
            groups
                .iter()
                .position(|g| g.params.matches(name))
                .unwrap_or(groups.len())
        })
        .collect();

    for (index, group) in groups.iter().enumerate() {
        if assignment.contains(&index) {
            continue;
        }
        let reason = match names.iter().find(|n| group.params.matches(n)) {
            None => format!(
                "group `{}` ({}) matches none of the {} parameters",
                group.name,
                group.params.describe(),
                names.len()
            ),
            Some(taken) => format!(
                "group `{}` ({}) receives no parameter: earlier groups took all it matches, \
                 such as `{taken}`",
                group.name,
                group.params.describe()
            ),
        };
        return Err(Error::invalid_argument(
            format!("param_groups.{}.params", group.name),
            reason,
        ));
    }
    Ok(assignment)
}

/// One parameter group's hyper-parameters as an optimizer applies them (and
/// schedulers change them): the group's name, learning rate and weight decay.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupHyper {
    /// The group's name (`"default"` for parameters no group selects).
    pub name: String,
    /// Learning rate.
    pub lr: f64,
    /// Weight decay.
    pub weight_decay: f64,
}

/// The groups' hyper-parameters and each parameter's group index, as every
/// backend's optimizer builds them: a group's own `lr`/`weight_decay` or the
/// config's, and a last `"default"` group for parameters no group selects (only
/// when there are such parameters). Fails as [`assign_groups`] does.
///
/// ```
/// use kiln_core::optim::{resolve_groups, OptimizerConfig, ParamGroup, ParamSelector, SgdConfig};
///
/// let names = vec!["0.weight".to_owned(), "1.weight".to_owned()];
/// let groups = [ParamGroup::new("first", ParamSelector::Prefix("0.".into())).with_lr(0.5)];
/// let (hypers, assignment) =
///     resolve_groups(&OptimizerConfig::Sgd(SgdConfig::new(0.1)), &names, &groups)?;
/// assert_eq!(assignment, [0, 1]);
/// assert_eq!((hypers[0].lr, hypers[1].name.as_str(), hypers[1].lr), (0.5, "default", 0.1));
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn resolve_groups(
    config: &crate::optim::OptimizerConfig,
    names: &[String],
    groups: &[ParamGroup],
) -> Result<(Vec<GroupHyper>, Vec<usize>)> {
    let assignment = assign_groups(names, groups)?;
    let (base_lr, base_wd) = (config.lr(), config.weight_decay());
    let mut hypers: Vec<GroupHyper> = groups
        .iter()
        .map(|g| GroupHyper {
            name: g.name.clone(),
            lr: g.lr.unwrap_or(base_lr),
            weight_decay: g.weight_decay.unwrap_or(base_wd),
        })
        .collect();
    if assignment.contains(&groups.len()) {
        hypers.push(GroupHyper {
            name: "default".to_owned(),
            lr: base_lr,
            weight_decay: base_wd,
        });
    }
    Ok((hypers, assignment))
}

/// Sets each group's learning rate; fails with [`Error::InvalidArgument`] naming
/// the groups unless there is exactly one rate per group (nothing changes then).
pub fn set_group_learning_rates(groups: &mut [GroupHyper], lrs: &[f64]) -> Result<()> {
    if lrs.len() != groups.len() {
        let names: Vec<&str> = groups.iter().map(|g| g.name.as_str()).collect();
        return Err(Error::invalid_argument(
            "lrs",
            format!(
                "this optimizer has {} parameter group(s) ({}), got {} learning rates",
                groups.len(),
                names.join(", "),
                lrs.len()
            ),
        ));
    }
    for (group, lr) in groups.iter_mut().zip(lrs) {
        group.lr = *lr;
    }
    Ok(())
}

/// Writes `group.<i>.lr` and `group.<i>.weight_decay` (f64 scalars) into `out`.
pub fn save_group_hypers(groups: &[GroupHyper], out: &mut crate::state_dict::StateDict) {
    for (i, group) in groups.iter().enumerate() {
        out.insert(
            format!("group.{i}.lr"),
            crate::tensor::HostTensor::scalar(group.lr),
        );
        out.insert(
            format!("group.{i}.weight_decay"),
            crate::tensor::HostTensor::scalar(group.weight_decay),
        );
    }
}

/// `groups` with the values [`save_group_hypers`] wrote into `state` where present.
pub fn load_group_hypers(
    groups: &[GroupHyper],
    state: &crate::state_dict::StateDict,
) -> Vec<GroupHyper> {
    let read = |key: String, current: f64| {
        state
            .get(&key)
            .and_then(|t| t.to_f64_vec().first().copied())
            .unwrap_or(current)
    };
    groups
        .iter()
        .enumerate()
        .map(|(i, g)| GroupHyper {
            name: g.name.clone(),
            lr: read(format!("group.{i}.lr"), g.lr),
            weight_decay: read(format!("group.{i}.weight_decay"), g.weight_decay),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        [
            "encoder.0.weight",
            "encoder.0.bias",
            "encoder.1.weight",
            "head.weight",
            "head.bias",
        ]
        .map(String::from)
        .to_vec()
    }

    #[test]
    fn first_matching_group_wins_and_rest_go_to_default() -> Result<()> {
        let groups = [
            ParamGroup::new("no_decay", ParamSelector::Suffix("bias".into()))
                .with_weight_decay(0.0),
            ParamGroup::new("encoder", ParamSelector::Prefix("encoder.".into())).with_lr(1e-4),
        ];
        assert_eq!(assign_groups(&names(), &groups)?, vec![1, 0, 1, 2, 0]);
        // Without groups everything is in the default group 0.
        assert_eq!(assign_groups(&names(), &[])?, vec![0; 5]);
        let all = [ParamGroup::new("all", ParamSelector::All)];
        assert_eq!(assign_groups(&names(), &all)?, vec![0; 5]);
        let picked = [ParamGroup::new(
            "head",
            ParamSelector::Names(vec!["head.bias".into(), "head.weight".into()]),
        )];
        assert_eq!(assign_groups(&names(), &picked)?, vec![1, 1, 1, 0, 0]);
        Ok(())
    }

    #[test]
    fn groups_that_receive_nothing_are_errors() {
        let groups = [ParamGroup::new(
            "decoder",
            ParamSelector::Prefix("decoder.".into()),
        )];
        let err = assign_groups(&names(), &groups).expect_err("no match");
        assert_eq!(
            err.to_string(),
            "invalid argument `param_groups.decoder.params`: group `decoder` (prefix `decoder.`) \
             matches none of the 5 parameters"
        );
        let groups = [
            ParamGroup::new("all", ParamSelector::All),
            ParamGroup::new("bias", ParamSelector::Suffix("bias".into())),
        ];
        let err = assign_groups(&names(), &groups).expect_err("shadowed");
        assert!(
            err.to_string()
                .contains("earlier groups took all it matches, such as `encoder.0.bias`"),
            "{err}"
        );
    }

    #[test]
    fn bad_groups_are_rejected() {
        let typo = [ParamGroup::new(
            "head",
            ParamSelector::Names(vec!["head.wieght".into()]),
        )];
        let err = assign_groups(&names(), &typo).expect_err("typo");
        assert!(err.to_string().contains("`head.wieght`"), "{err}");
        let twice = [
            ParamGroup::new("a", ParamSelector::Suffix("weight".into())),
            ParamGroup::new("a", ParamSelector::Suffix("bias".into())),
        ];
        assert!(assign_groups(&names(), &twice).is_err());
        let negative = [ParamGroup::new("a", ParamSelector::All).with_lr(-1.0)];
        let err = assign_groups(&names(), &negative).expect_err("negative lr");
        assert_eq!(
            err.to_string(),
            "invalid argument `param_groups.a.lr`: must be finite and >= 0, got -1"
        );
    }

    #[test]
    fn serde_is_hand_writable() -> Result<()> {
        let json = r#"[
            {"name": "no_decay", "params": {"suffix": "bias"}, "weight_decay": 0.0},
            {"name": "everything", "params": "all", "lr": 0.1},
            {"name": "some", "params": {"names": ["a", "b"]}}
        ]"#;
        let groups: Vec<ParamGroup> = serde_json::from_str(json)
            .map_err(|e| Error::invalid_argument("json", e.to_string()))?;
        assert_eq!(
            groups,
            [
                ParamGroup::new("no_decay", ParamSelector::Suffix("bias".into()))
                    .with_weight_decay(0.0),
                ParamGroup::new("everything", ParamSelector::All).with_lr(0.1),
                ParamGroup::new("some", ParamSelector::Names(vec!["a".into(), "b".into()])),
            ]
        );
        Ok(())
    }
}

//! `config_builder!`: a config's `new` and `with_*` setters from one declaration.

/// Generates a config's constructor and `with_*` setters:
///
/// ```text
/// config_builder! {
///     LinearConfig {
///         /// A linear layer with bias and PyTorch's default initialisation.
///         new(in_features: usize, out_features: usize) {
///             in_features,
///             out_features,
///             bias: true,
///             weight_init: None,
///             bias_init: None,
///         }
///         /// Sets whether the layer has a bias.
///         with_bias(bias: bool);
///         /// Sets the initialiser of `weight`.
///         with_weight_init(weight_init: Some(Init));
///     }
/// }
/// ```
///
/// `new` takes the required fields and lists every field's starting value
/// (PyTorch's defaults, the same a config file gets). A setter
/// `with_x(field: T)` sets `field`; `with_x(field: Some(T))` sets an optional
/// field to `Some` of its argument.
macro_rules! config_builder {
    (@setter $(#[$doc:meta])* $setter:ident($field:ident: Some($ty:ty))) => {
        $(#[$doc])*
        pub fn $setter(mut self, $field: $ty) -> Self {
            self.$field = Some($field);
            self
        }
    };
    (@setter $(#[$doc:meta])* $setter:ident($field:ident: $ty:ty)) => {
        $(#[$doc])*
        pub fn $setter(mut self, $field: $ty) -> Self {
            self.$field = $field;
            self
        }
    };
    (
        $config:ident {
            $(#[$new_doc:meta])*
            new($($arg:ident: $arg_ty:ty),* $(,)?) { $($init:tt)* }
            $($(#[$doc:meta])* $setter:ident($field:ident: $($ty:tt)+);)*
        }
    ) => {
        impl $config {
            $(#[$new_doc])*
            pub fn new($($arg: $arg_ty),*) -> Self {
                Self { $($init)* }
            }

            $(config_builder!(@setter $(#[$doc])* $setter($field: $($ty)+));)*
        }
    };
}

pub(super) use config_builder;

//! `#[shallot_guest::filter]`: turns an `impl Filter for T` block into an
//! exported shallot component. See the `shallot-guest` crate for the API.

use proc_macro::TokenStream;
use quote::{format_ident, quote};
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::{ImplItem, ItemImpl, LitStr, Meta, Token, parse_macro_input, parse_quote};

/// Exports the filter implemented by the annotated `impl Filter for T` block.
///
/// The hooks written in the block are the ones the host will call; every
/// other hook is skipped at no cost. `type State` defaults to `()`.
///
/// Options: `#[shallot_guest::filter(name = "my-filter")]` sets the default
/// filter name (otherwise the package name).
#[proc_macro_attribute]
pub fn filter(attr: TokenStream, item: TokenStream) -> TokenStream {
    let options = match Punctuated::<Meta, Token![,]>::parse_terminated.parse(attr) {
        Ok(options) => options,
        Err(e) => return e.to_compile_error().into(),
    };
    let mut name = None;
    for option in &options {
        match option {
            Meta::NameValue(nv) if nv.path.is_ident("name") => match &nv.value {
                syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Str(s),
                    ..
                }) => name = Some(s.value()),
                other => {
                    return syn::Error::new_spanned(other, "`name` takes a string")
                        .to_compile_error()
                        .into();
                }
            },
            other => {
                return syn::Error::new_spanned(other, "unknown option; expected `name = \"...\"`")
                    .to_compile_error()
                    .into();
            }
        }
    }
    let name = name.unwrap_or_else(|| std::env::var("CARGO_PKG_NAME").unwrap_or_default());
    let name = LitStr::new(&name, proc_macro2::Span::call_site());

    let mut block = parse_macro_input!(item as ItemImpl);
    let self_ty = block.self_ty.clone();
    let mut hooks = Vec::new();
    let mut has_state = false;
    for item in &block.items {
        match item {
            ImplItem::Fn(f) => {
                let hook = match f.sig.ident.to_string().as_str() {
                    "around_chat" => Some("AroundChat"),
                    "around_tool" => Some("AroundTool"),
                    "around_turn" => Some("AroundTurn"),
                    "token_transform" => Some("TokenTransform"),
                    "system_prompt" => Some("SystemPrompt"),
                    _ => None,
                };
                if let Some(hook) = hook {
                    let variant = format_ident!("{}", hook);
                    hooks.push(quote!(::shallot_guest::Hook::#variant));
                }
            }
            ImplItem::Type(t) if t.ident == "State" => has_state = true,
            _ => {}
        }
    }
    if !has_state {
        block.items.push(parse_quote!(
            type State = ();
        ));
    }

    quote! {
        #block

        const _: () = {
            static FILTER: ::std::sync::OnceLock<#self_ty> = ::std::sync::OnceLock::new();

            impl ::shallot_guest::__private::Export for #self_ty {
                const NAME: &'static str = #name;
                const VERSION: &'static str = ::core::env!("CARGO_PKG_VERSION");
                const HOOKS: &'static [::shallot_guest::Hook] = &[#(#hooks),*];
                fn slot() -> &'static ::std::sync::OnceLock<Self> {
                    &FILTER
                }
            }

            type ShallotExport = ::shallot_guest::__private::Adapter<#self_ty>;
            ::shallot_guest::__private::export_world!(ShallotExport with_types_in ::shallot_guest::bindings);
        };
    }
    .into()
}

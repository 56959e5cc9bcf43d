//! `#[shallot_guest::filter]`: turns an `impl Filter for T` block into an
//! exported shallot component; `#[shallot_guest::around_chat]` (and
//! `around_tool`, `around_turn`) does the same for one function. See the
//! `shallot-guest` crate for the API.

use proc_macro::TokenStream;
use quote::{format_ident, quote};
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::{
    Expr, ImplItem, ImplItemFn, ItemFn, ItemImpl, LitStr, Meta, Stmt, Token, parse_macro_input,
    parse_quote,
};

/// Exports the filter implemented by the annotated `impl Filter for T` block.
///
/// The hooks written in the block are the ones the host will call; every
/// other hook is skipped at no cost. A `token_transform` whose body is
/// `Box::new(PassThrough)` changes nothing and is left out too: the host
/// opens no transformer for its streams. `type State` defaults to `()`.
///
/// Options: `#[shallot_guest::filter(name = "my-filter")]` sets the default
/// filter name (otherwise the package name).
#[proc_macro_attribute]
pub fn filter(attr: TokenStream, item: TokenStream) -> TokenStream {
    let name = match filter_name(attr) {
        Ok(name) => name,
        Err(e) => return e.to_compile_error().into(),
    };
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
                    "token_transform" if !passes_through(f) => Some("TokenTransform"),
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

/// Whether `f`'s body is `Box::new(PassThrough)` (by any path): the SDK's
/// identity transform, which the host need not run.
fn passes_through(f: &ImplItemFn) -> bool {
    let [Stmt::Expr(Expr::Call(call), None)] = f.block.stmts.as_slice() else {
        return false;
    };
    let names = |expr: &Expr| match expr {
        Expr::Path(path) => path
            .path
            .segments
            .iter()
            .map(|s| s.ident.to_string())
            .collect(),
        _ => Vec::new(),
    };
    let made = names(&call.func);
    let boxed = made.ends_with(&["Box".to_owned(), "new".to_owned()]);
    let argument = call.args.iter().map(names).collect::<Vec<_>>();
    boxed
        && matches!(argument.as_slice(), [path] if path.last().is_some_and(|n| n == "PassThrough"))
}

/// The `name = "..."` option, or the package's name.
fn filter_name(attr: TokenStream) -> syn::Result<LitStr> {
    let options = Punctuated::<Meta, Token![,]>::parse_terminated.parse(attr)?;
    let mut name = None;
    for option in &options {
        match option {
            Meta::NameValue(nv) if nv.path.is_ident("name") => match &nv.value {
                syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Str(s),
                    ..
                }) => name = Some(s.value()),
                other => return Err(syn::Error::new_spanned(other, "`name` takes a string")),
            },
            other => {
                return Err(syn::Error::new_spanned(
                    other,
                    "unknown option; expected `name = \"...\"`",
                ));
            }
        }
    }
    let name = name.unwrap_or_else(|| std::env::var("CARGO_PKG_NAME").unwrap_or_default());
    Ok(LitStr::new(&name, proc_macro2::Span::call_site()))
}

/// A stateless filter with one around-chat hook, written as one function
/// `fn name(request: &ChatRequest, next: Next) -> Result<ChatResponse,
/// FilterError>`; exported as `#[shallot_guest::filter]` exports an impl
/// block (same `name = "..."` option). The filter takes no configuration:
/// whatever the operator gives is ignored.
#[proc_macro_attribute]
pub fn around_chat(attr: TokenStream, item: TokenStream) -> TokenStream {
    one_hook(
        attr,
        item,
        quote!(around_chat),
        quote!(ChatRequest),
        quote!(::core::result::Result<::shallot_guest::ChatResponse, ::shallot_guest::FilterError>),
    )
}

/// As [`around_chat`], for one around-tool hook: `fn name(request:
/// &ToolRequest, next: Next) -> Result<ToolResponse, FilterError>`.
#[proc_macro_attribute]
pub fn around_tool(attr: TokenStream, item: TokenStream) -> TokenStream {
    one_hook(
        attr,
        item,
        quote!(around_tool),
        quote!(ToolRequest),
        quote!(::core::result::Result<::shallot_guest::ToolResponse, ::shallot_guest::FilterError>),
    )
}

/// As [`around_chat`], for one around-turn hook: `fn name(request:
/// &TurnRequest, next: Next) -> TurnResult`.
#[proc_macro_attribute]
pub fn around_turn(attr: TokenStream, item: TokenStream) -> TokenStream {
    one_hook(
        attr,
        item,
        quote!(around_turn),
        quote!(TurnRequest),
        quote!(::shallot_guest::TurnResult),
    )
}

/// Exports the function `item` as the `hook` of a filter with no state and
/// no configuration.
fn one_hook(
    attr: TokenStream,
    item: TokenStream,
    hook: proc_macro2::TokenStream,
    request: proc_macro2::TokenStream,
    output: proc_macro2::TokenStream,
) -> TokenStream {
    let name = match filter_name(attr) {
        Ok(name) => name,
        Err(e) => return e.to_compile_error().into(),
    };
    let function = parse_macro_input!(item as ItemFn);
    if function.sig.inputs.len() != 2 {
        let message = format!(
            "expected `fn {}(request: &{request}, next: Next)`",
            function.sig.ident
        );
        return syn::Error::new_spanned(&function.sig, message)
            .to_compile_error()
            .into();
    }
    let ident = &function.sig.ident;
    let ty = format_ident!("__ShallotFilter_{}", ident);
    quote! {
        #function

        #[allow(non_camel_case_types)]
        struct #ty;

        impl<'de> ::shallot_guest::__private::serde::Deserialize<'de> for #ty {
            fn deserialize<D>(deserializer: D) -> ::core::result::Result<Self, D::Error>
            where
                D: ::shallot_guest::__private::serde::Deserializer<'de>,
            {
                <::shallot_guest::__private::serde::de::IgnoredAny as ::shallot_guest::__private::serde::Deserialize>::deserialize(deserializer)?;
                ::core::result::Result::Ok(#ty)
            }
        }

        #[::shallot_guest::filter(name = #name)]
        impl ::shallot_guest::Filter for #ty {
            fn #hook(
                &self,
                request: &::shallot_guest::#request,
                next: ::shallot_guest::Next,
            ) -> #output {
                #ident(request, next)
            }
        }
    }
    .into()
}
